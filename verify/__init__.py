"""Verification tools: the comparison core, case strategies and the command-line checks."""
