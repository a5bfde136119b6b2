"""file expiry: when each Batch API file expires (``expires_after``), and a batch's expiry for its output files

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-10
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('files', sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
    op.create_index(op.f('ix_files_expires_at'), 'files', ['expires_at'], unique=False)
    op.add_column('batch_jobs', sa.Column('output_expires_s', sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column('batch_jobs', 'output_expires_s')
    op.drop_index(op.f('ix_files_expires_at'), table_name='files')
    op.drop_column('files', 'expires_at')
