"""Alembic migration environment and revisions of the server database."""
