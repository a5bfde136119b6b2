"""batch api: files, batch_jobs, batch_lines (the Batch API: uploaded and output files, jobs, their lines)

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('batch_jobs',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('endpoint', sa.String(length=64), nullable=False),
    sa.Column('input_file_id', sa.String(length=64), nullable=False),
    sa.Column('completion_window', sa.String(length=16), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('meta', sa.Text(), nullable=True),
    sa.Column('errors', sa.Text(), nullable=True),
    sa.Column('total', sa.Integer(), nullable=False),
    sa.Column('completed', sa.Integer(), nullable=False),
    sa.Column('failed', sa.Integer(), nullable=False),
    sa.Column('output_file_id', sa.String(length=64), nullable=True),
    sa.Column('error_file_id', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=False),
    sa.Column('in_progress_at', sa.Float(), nullable=True),
    sa.Column('finalizing_at', sa.Float(), nullable=True),
    sa.Column('completed_at', sa.Float(), nullable=True),
    sa.Column('failed_at', sa.Float(), nullable=True),
    sa.Column('expired_at', sa.Float(), nullable=True),
    sa.Column('cancelling_at', sa.Float(), nullable=True),
    sa.Column('cancelled_at', sa.Float(), nullable=True),
    sa.Column('lease_owner', sa.String(length=128), nullable=True),
    sa.Column('lease_until', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('batch_jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_batch_jobs_status'), ['status'], unique=False)
        batch_op.create_index(batch_op.f('ix_batch_jobs_tenant'), ['tenant'], unique=False)

    op.create_table('files',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('purpose', sa.String(length=32), nullable=False),
    sa.Column('filename', sa.String(length=255), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_files_tenant'), ['tenant'], unique=False)

    op.create_table('batch_lines',
    sa.Column('job_id', sa.String(length=64), nullable=False),
    sa.Column('line_no', sa.Integer(), nullable=False),
    sa.Column('custom_id', sa.Text(), nullable=False),
    sa.Column('request_id', sa.String(length=128), nullable=False),
    sa.Column('body', sa.Text(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('status_code', sa.Integer(), nullable=True),
    sa.Column('output', sa.Text(), nullable=True),
    sa.Column('finished_at', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['batch_jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'line_no')
    )
    with op.batch_alter_table('batch_lines', schema=None) as batch_op:
        batch_op.create_index('ix_batch_lines_job_status', ['job_id', 'status'], unique=False)
        batch_op.create_index(batch_op.f('ix_batch_lines_request_id'), ['request_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('batch_lines', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_batch_lines_request_id'))
        batch_op.drop_index('ix_batch_lines_job_status')

    op.drop_table('batch_lines')
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_files_tenant'))

    op.drop_table('files')
    with op.batch_alter_table('batch_jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_batch_jobs_tenant'))
        batch_op.drop_index(batch_op.f('ix_batch_jobs_status'))

    op.drop_table('batch_jobs')
