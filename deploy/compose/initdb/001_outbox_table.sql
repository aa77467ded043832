-- `outbox-relay setup` output for the default names (table public.outbox,
-- publication and slot outbox_relay, role outbox_relay): sql/001_outbox_table.sql rendered,
-- for docker-compose.yml, whose postgres runs it on its first start
-- (/docker-entrypoint-initdb.d). Do not edit by hand: a test keeps what
-- follows this comment block equal to the relay's rendering, which
-- `outbox-relay --config deploy/compose/relay.toml setup` prints.

-- outbox-relay 001: the outbox table and its indexes.
-- Rendered by `outbox-relay setup --config FILE` for the configured names;
-- Double-brace placeholders are filled in: bare ones as quoted identifiers,
-- single-quoted ones as string literals.
-- Applications insert the first eight columns in the same transaction as
-- their business rows; the relay manages the rest.
CREATE TABLE IF NOT EXISTS public.outbox (
    id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb,
    topic          text,
    created_at     timestamptz NOT NULL DEFAULT now(),
    -- relay-managed
    publish_state   text        NOT NULL DEFAULT 'PENDING'
                    CHECK (publish_state IN ('PENDING', 'PUBLISHED', 'FAILED', 'DEAD', 'SKIPPED')),
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    next_attempt_at timestamptz,
    published_at    timestamptz
);

-- The fallback poller looks for rows still to publish, oldest first.
CREATE INDEX IF NOT EXISTS outbox_due_idx
    ON public.outbox (created_at)
    WHERE publish_state IN ('PENDING', 'FAILED');

-- Retention deletes published (and skipped) rows by age.
CREATE INDEX IF NOT EXISTS outbox_published_idx
    ON public.outbox (published_at)
    WHERE publish_state IN ('PUBLISHED', 'SKIPPED');
