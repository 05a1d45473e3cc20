"""What the user sees of results: the live view of a run and its tables."""
