"""State held in the SQL database: the outcome ledger, tenants and API keys (tables in models.py, schema
migrated by Alembic in migrations/)."""
