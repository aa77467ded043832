-- outbox-relay 009: the view <table>_state, every column of the outbox table
-- and `state`: the row's state as the relay reads it (PENDING, PUBLISHED,
-- FAILED, DEAD or SKIPPED). Under the derived lifecycle a published row keeps
-- publish_state = 'PENDING' and is PUBLISHED here once its transaction id is
-- visible in the snapshot the relay vouched for (in the position table's row
-- of the configured slot): query rows by state here, e.g.
--   SELECT count(*) FROM <table>_state WHERE state = 'PENDING';
-- The expression is the relay's own (postgres::outbox::derived), so the view,
-- the poller, retention and `status` agree. Made again each time (the table's
-- columns may have changed); only for a table with publish_state and
-- relay_txid. With it, the trigger <table>_requeue (below).
DO $$
BEGIN
    DROP VIEW IF EXISTS {{schema}}.{{state_view}};
    IF (SELECT count(*) FROM pg_attribute
         WHERE attrelid = to_regclass({{'table_regclass'}}) AND NOT attisdropped
           AND (attname = 'publish_state' OR (attname = 'relay_txid' AND atttypid = 'xid8'::regtype))) = 2
       AND to_regclass({{'position_regclass'}}) IS NOT NULL
    THEN
        CREATE VIEW {{schema}}.{{state_view}} AS
            SELECT o.*, {{=state}} AS state
              FROM {{schema}}.{{table}} o
              {{=position_join}};
        GRANT SELECT ON {{schema}}.{{state_view}} TO {{role}};
        -- A row set to PENDING by hand (to send it again; a row published by
        -- the derived rule is PENDING on disk already) loses its transaction
        -- id: with it, the row would read as published and never be sent.
        -- Without one the poller publishes it (explicit state). Only such
        -- updates fire it (the relay never writes PENDING); inserts cost nothing.
        -- ENABLE ALWAYS: it fires under session_replication_role = replica too
        -- (data fixes run so to skip foreign-key triggers), which an ordinary
        -- trigger does not.
        CREATE OR REPLACE FUNCTION {{schema}}.{{requeue}}() RETURNS trigger
            LANGUAGE plpgsql AS $requeue$
        BEGIN
            NEW.relay_txid := NULL;
            RETURN NEW;
        END
        $requeue$;
        DROP TRIGGER IF EXISTS {{requeue}} ON {{schema}}.{{table}};
        CREATE TRIGGER {{requeue}} BEFORE UPDATE OF publish_state ON {{schema}}.{{table}}
            FOR EACH ROW WHEN (NEW.publish_state = 'PENDING')
            EXECUTE FUNCTION {{schema}}.{{requeue}}();
        ALTER TABLE {{schema}}.{{table}} ENABLE ALWAYS TRIGGER {{requeue}};
    END IF;
END
$$;
