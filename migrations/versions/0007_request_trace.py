"""request trace: the OpenTelemetry trace id of each request's call (tracing on), to find its spans

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('requests', sa.Column('trace_id', sa.String(length=32), nullable=True))


def downgrade() -> None:
    op.drop_column('requests', 'trace_id')
