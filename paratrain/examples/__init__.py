"""Small runnable examples (``python -m paratrain.examples.NAME`` under ``paratrain launch``)."""
