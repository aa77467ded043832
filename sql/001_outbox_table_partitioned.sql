-- outbox-relay 001 (partitioned variant, `outbox-relay setup --partitioned`):
-- the outbox table partitioned by range of created_at, so retention can drop
-- whole old partitions (retention.drop_partitions = true) instead of deleting
-- rows. The relay sees one table (the publication publishes via the root).
-- Create partitions ahead of time (e.g. daily or monthly, by cron or
-- pg_partman); rows outside every partition land in the default partition.
-- A new table gets the derived lifecycle's indexes here, on the parent (every
-- partition gets its own, now and when created or attached later). A table
-- from before the derived lifecycle is left as it is: 007 and 008 migrate it
-- online.
DO $$
BEGIN
    IF to_regclass({{'table_regclass'}}) IS NOT NULL THEN
        RETURN;
    END IF;
    CREATE TABLE {{schema}}.{{table}} (
        {{col_id}}             uuid        NOT NULL DEFAULT gen_random_uuid(),
        {{col_aggregate_type}} text        NOT NULL,
        {{col_aggregate_id}}   text        NOT NULL,
        {{col_event_type}}     text        NOT NULL,
        {{col_payload}}        jsonb       NOT NULL,
        {{col_headers}}        jsonb,
        {{col_topic}}          text,
        {{col_created_at}}     timestamptz NOT NULL DEFAULT now(),
        publish_state   text        NOT NULL DEFAULT 'PENDING'
                        CHECK (publish_state IN ('PENDING', 'PUBLISHED', 'FAILED', 'DEAD', 'SKIPPED')),
        attempts        integer     NOT NULL DEFAULT 0,
        last_error      text,
        next_attempt_at timestamptz,
        published_at    timestamptz,
        relay_txid      xid8        DEFAULT pg_current_xact_id(),
        PRIMARY KEY ({{col_id}}, {{col_created_at}})
    ) PARTITION BY RANGE ({{col_created_at}});

    CREATE INDEX {{table_txid_index}}
        ON {{schema}}.{{table}} (relay_txid)
        WHERE publish_state = 'PENDING';

    CREATE INDEX {{table_explicit_index}}
        ON {{schema}}.{{table}} ({{col_created_at}})
        WHERE publish_state = 'FAILED' OR (publish_state = 'PENDING' AND relay_txid IS NULL);
END
$$;

CREATE TABLE IF NOT EXISTS {{schema}}.{{table_default_partition}}
    PARTITION OF {{schema}}.{{table}} DEFAULT;

CREATE INDEX IF NOT EXISTS {{table_published_index}}
    ON {{schema}}.{{table}} (published_at)
    WHERE publish_state IN ('PUBLISHED', 'SKIPPED');

-- The relay looks rows up by id alone (marking, failures, replay).
CREATE INDEX IF NOT EXISTS {{table_id_index}}
    ON {{schema}}.{{table}} ({{col_id}});
