"""ledger: requests, batches, batch_requests, quarantined_inputs

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('batches',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('parent_id', sa.String(length=64), nullable=True),
    sa.Column('model', sa.String(length=128), nullable=False),
    sa.Column('worker', sa.String(length=255), nullable=True),
    sa.Column('size', sa.Integer(), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('run_ms', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_batches_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_batches_parent_id'), ['parent_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_batches_status'), ['status'], unique=False)
        batch_op.create_index(batch_op.f('ix_batches_worker'), ['worker'], unique=False)

    op.create_table('quarantined_inputs',
    sa.Column('input_hash', sa.String(length=32), nullable=False),
    sa.Column('model', sa.String(length=128), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('batch_id', sa.String(length=64), nullable=False),
    sa.Column('request_id', sa.String(length=64), nullable=False),
    sa.Column('input', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('released_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('input_hash')
    )
    op.create_table('requests',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('correlation_id', sa.String(length=128), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('model', sa.String(length=128), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('input_hash', sa.String(length=32), nullable=False),
    sa.Column('input', sa.Text(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('batch_id', sa.String(length=64), nullable=True),
    sa.Column('accepted_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('queued_ms', sa.Float(), nullable=True),
    sa.Column('run_ms', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_requests_accepted_at'), ['accepted_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_requests_correlation_id'), ['correlation_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_requests_input_hash'), ['input_hash'], unique=False)
        batch_op.create_index(batch_op.f('ix_requests_model'), ['model'], unique=False)
        batch_op.create_index(batch_op.f('ix_requests_status'), ['status'], unique=False)
        batch_op.create_index(batch_op.f('ix_requests_tenant'), ['tenant'], unique=False)

    op.create_table('batch_requests',
    sa.Column('batch_id', sa.String(length=64), nullable=False),
    sa.Column('request_id', sa.String(length=64), nullable=False),
    sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('batch_id', 'request_id')
    )
    with op.batch_alter_table('batch_requests', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_batch_requests_request_id'), ['request_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('batch_requests', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_batch_requests_request_id'))

    op.drop_table('batch_requests')
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_requests_tenant'))
        batch_op.drop_index(batch_op.f('ix_requests_status'))
        batch_op.drop_index(batch_op.f('ix_requests_model'))
        batch_op.drop_index(batch_op.f('ix_requests_input_hash'))
        batch_op.drop_index(batch_op.f('ix_requests_correlation_id'))
        batch_op.drop_index(batch_op.f('ix_requests_accepted_at'))

    op.drop_table('requests')
    op.drop_table('quarantined_inputs')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_batches_worker'))
        batch_op.drop_index(batch_op.f('ix_batches_status'))
        batch_op.drop_index(batch_op.f('ix_batches_parent_id'))
        batch_op.drop_index(batch_op.f('ix_batches_created_at'))

    op.drop_table('batches')
