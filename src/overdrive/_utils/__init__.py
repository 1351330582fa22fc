"""Small shared helpers: errors, optional imports, device facts, timing, how a module takes its inputs (by name)."""
