-- The outbox table as `outbox-relay setup` created it before the derived
-- lifecycle (sql/001_outbox_table.sql at b52e47e, rendered for
-- public.outbox): no relay_txid, the old poller index outbox_due_idx. The
-- migration tests (tests/tests/e2e/migration.rs) and
-- scripts/migration-lock.sh start from it.
CREATE TABLE public.outbox (
    id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb,
    topic          text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    publish_state   text        NOT NULL DEFAULT 'PENDING'
                    CHECK (publish_state IN ('PENDING', 'PUBLISHED', 'FAILED', 'DEAD', 'SKIPPED')),
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    next_attempt_at timestamptz,
    published_at    timestamptz
);
CREATE INDEX outbox_due_idx ON public.outbox (created_at)
    WHERE publish_state IN ('PENDING', 'FAILED');
CREATE INDEX outbox_published_idx ON public.outbox (published_at)
    WHERE publish_state IN ('PUBLISHED', 'SKIPPED');
