"""Benchmarks behind ``paratrain bench``: paratrain's collectives timed against Gloo and OpenMPI in one run."""
