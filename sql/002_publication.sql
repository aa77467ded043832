-- outbox-relay 002: the publication. Inserts only: the relay's own updates
-- (marking rows published) and deletes (retention) never reach the stream.
-- publish_via_partition_root: a partitioned outbox streams as one table.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = {{'publication'}}) THEN
        CREATE PUBLICATION {{publication}} FOR TABLE {{schema}}.{{table}}
            WITH (publish = 'insert', publish_via_partition_root = true);
    END IF;
END
$$;
