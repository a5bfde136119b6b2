"""request params: what each call asked for besides its input (generation parameters, chat, priority)

Kept on every ledger request so `llmb-admin replay` and `requeue` send the same call again.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('requests', sa.Column('params', sa.Text(), nullable=True))
    op.add_column('requests', sa.Column('priority', sa.String(length=16), nullable=True))


def downgrade() -> None:
    op.drop_column('requests', 'priority')
    op.drop_column('requests', 'params')
