"""Small shared helpers: errors, optional imports, device facts, timing."""
