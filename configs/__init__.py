"""Gin configuration files shipped with t5lite (mapped from the repository's configs/)."""
