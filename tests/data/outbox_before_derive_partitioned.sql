-- The partitioned outbox table as `outbox-relay setup --partitioned` created
-- it before the derived lifecycle (sql/001_outbox_table_partitioned.sql at
-- b52e47e, rendered for public.outbox), with a partition holding today
-- besides the default one. For tests/tests/e2e/migration.rs.
CREATE TABLE public.outbox (
    id             uuid        NOT NULL DEFAULT gen_random_uuid(),
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
    published_at    timestamptz,
    PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at);
CREATE TABLE public.outbox_default PARTITION OF public.outbox DEFAULT;
CREATE INDEX outbox_due_idx ON public.outbox (created_at)
    WHERE publish_state IN ('PENDING', 'FAILED');
CREATE INDEX outbox_published_idx ON public.outbox (published_at)
    WHERE publish_state IN ('PUBLISHED', 'SKIPPED');
CREATE INDEX outbox_id_idx ON public.outbox (id);
DO $$
BEGIN
    EXECUTE format('CREATE TABLE public.outbox_today PARTITION OF public.outbox FOR VALUES FROM (%L) TO (%L)',
                   now() - interval '1 day', now() + interval '1 day');
END
$$;
