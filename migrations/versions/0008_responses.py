"""responses: the Responses API's stored responses (their Response object, input items and conversation)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('responses',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('request_id', sa.String(length=128), nullable=False),
    sa.Column('body', sa.Text(), nullable=False),
    sa.Column('request', sa.Text(), nullable=False),
    sa.Column('input_items', sa.Text(), nullable=False),
    sa.Column('history', sa.Text(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index(op.f('ix_responses_tenant'), 'responses', ['tenant'], unique=False)
    op.create_index(op.f('ix_responses_expires_at'), 'responses', ['expires_at'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_responses_expires_at'), table_name='responses')
    op.drop_index(op.f('ix_responses_tenant'), table_name='responses')
    op.drop_table('responses')
