"""Fault tests: real worker processes, a fenced sink and a TCP proxy (issue 5)."""
