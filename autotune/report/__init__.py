"""What the user sees of results: the live view of a run, its tables and the HTML report."""
