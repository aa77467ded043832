-- outbox-relay 001: the outbox table and its indexes.
-- Rendered by `outbox-relay setup --config FILE` for the configured names;
-- Double-brace placeholders are filled in: bare ones as quoted identifiers,
-- single-quoted ones as string literals.
-- Applications insert the first eight columns in the same transaction as
-- their business rows; the relay manages the rest.
CREATE TABLE IF NOT EXISTS {{schema}}.{{table}} (
    {{col_id}}             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    {{col_aggregate_type}} text        NOT NULL,
    {{col_aggregate_id}}   text        NOT NULL,
    {{col_event_type}}     text        NOT NULL,
    {{col_payload}}        jsonb       NOT NULL,
    {{col_headers}}        jsonb,
    {{col_topic}}          text,
    {{col_created_at}}     timestamptz NOT NULL DEFAULT now(),
    -- relay-managed
    publish_state   text        NOT NULL DEFAULT 'PENDING'
                    CHECK (publish_state IN ('PENDING', 'PUBLISHED', 'FAILED', 'DEAD', 'SKIPPED')),
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    next_attempt_at timestamptz,
    published_at    timestamptz
);

-- The fallback poller looks for rows still to publish, oldest first.
CREATE INDEX IF NOT EXISTS {{table_due_index}}
    ON {{schema}}.{{table}} ({{col_created_at}})
    WHERE publish_state IN ('PENDING', 'FAILED');

-- Retention deletes published (and skipped) rows by age.
CREATE INDEX IF NOT EXISTS {{table_published_index}}
    ON {{schema}}.{{table}} (published_at)
    WHERE publish_state IN ('PUBLISHED', 'SKIPPED');
