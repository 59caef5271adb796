"""Model-parallel scheduling: STRADS-style dependency-aware scheduling and GraphLab-style consistency by colouring."""
