"""pyinfra facts: what a box has now. Each module reads one kind of thing."""
