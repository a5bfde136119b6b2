"""adapters: registered LoRA adapters (issue 44), and the adapter each ledger request ran with

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('adapters',
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('base_model', sa.String(length=128), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=True),
    sa.Column('pinned', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_index(op.f('ix_adapters_tenant'), 'adapters', ['tenant'], unique=False)
    op.add_column('requests', sa.Column('adapter', sa.String(length=128), nullable=True))
    op.create_index(op.f('ix_requests_adapter'), 'requests', ['adapter'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_requests_adapter'), table_name='requests')
    op.drop_column('requests', 'adapter')
    op.drop_index(op.f('ix_adapters_tenant'), table_name='adapters')
    op.drop_table('adapters')
