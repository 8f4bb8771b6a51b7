"""Install helpers that run before the project's requirements are there: standard library only."""
