"""Starting and supervising the processes of a local job."""
