"""request tokens: the prompt and completion tokens each generation request took, as its OpenAI usage says

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('requests', sa.Column('prompt_tokens', sa.Integer(), nullable=True))
    op.add_column('requests', sa.Column('completion_tokens', sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column('requests', 'completion_tokens')
    op.drop_column('requests', 'prompt_tokens')
