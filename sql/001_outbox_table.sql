-- outbox-relay 001: the outbox table and its indexes.
-- Rendered by `outbox-relay setup --config FILE` for the configured names;
-- Double-brace placeholders are filled in: bare ones as quoted identifiers,
-- single-quoted ones as string literals.
-- Applications insert the first eight columns in the same transaction as
-- their business rows, naming them (docs/producers.md); the relay manages
-- the rest.
-- A new table gets every index here, while it is empty. A table from before
-- the derived lifecycle is left as it is: 007 and 008 migrate it online.
DO $$
BEGIN
    IF to_regclass({{'table_regclass'}}) IS NOT NULL THEN
        RETURN;
    END IF;
    CREATE TABLE {{schema}}.{{table}} (
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
        published_at    timestamptz,
        -- The writing transaction's top-level id (the derived lifecycle): a
        -- row is published once its id is visible in a snapshot the relay
        -- vouched for. Never set it: the default fills it.
        relay_txid      xid8        DEFAULT pg_current_xact_id()
    );

    -- Rows whose state is derived stay PENDING: the relay finds those a
    -- vouched snapshot may not cover yet by a range on their ids.
    CREATE INDEX {{table_txid_index}}
        ON {{schema}}.{{table}} (relay_txid)
        WHERE publish_state = 'PENDING';

    -- The fallback poller looks for rows with an explicit state still to
    -- publish (failed ones, and rows without an id), oldest first.
    CREATE INDEX {{table_explicit_index}}
        ON {{schema}}.{{table}} ({{col_created_at}})
        WHERE publish_state = 'FAILED' OR (publish_state = 'PENDING' AND relay_txid IS NULL);
END
$$;

-- Retention deletes published (and skipped) rows by age.
CREATE INDEX IF NOT EXISTS {{table_published_index}}
    ON {{schema}}.{{table}} (published_at)
    WHERE publish_state IN ('PUBLISHED', 'SKIPPED');
