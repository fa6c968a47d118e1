"""Helpers shared by megaport's tests (import as ``from support.gitrepos import ...``)."""
