"""Collective operations (barrier, and later allreduce and friends) executed over any transport."""
