"""``paratrain train``: whole training jobs on real data (digits, Fashion-MNIST) with any strategy."""
