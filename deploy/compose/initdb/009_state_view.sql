-- `outbox-relay setup` output for the default names (table public.outbox,
-- publication and slot outbox_relay, role outbox_relay): sql/009_state_view.sql rendered,
-- for docker-compose.yml, whose postgres runs it on its first start
-- (/docker-entrypoint-initdb.d). Do not edit by hand: a test keeps what
-- follows this comment block equal to the relay's rendering, which
-- `outbox-relay --config deploy/compose/relay.toml setup` prints.

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
    DROP VIEW IF EXISTS public.outbox_state;
    IF (SELECT count(*) FROM pg_attribute
         WHERE attrelid = to_regclass('public.outbox') AND NOT attisdropped
           AND (attname = 'publish_state' OR (attname = 'relay_txid' AND atttypid = 'xid8'::regtype))) = 2
       AND to_regclass('public.outbox_position') IS NOT NULL
    THEN
        CREATE VIEW public.outbox_state AS
            SELECT o.*, CASE WHEN coalesce(o.publish_state = 'PENDING' AND o.relay_txid IS NOT NULL AND p.hole_to IS NOT NULL AND p.system_identifier = (SELECT system_identifier::text FROM pg_control_system()) AND pg_snapshot_xmax(p.snapshot) <= pg_snapshot_xmax(pg_current_snapshot()) AND pg_visible_in_snapshot(o.relay_txid, p.snapshot) AND NOT EXISTS (SELECT 1 FROM unnest(p.hole_from, p.hole_to) AS h(f, t) WHERE o.relay_txid < pg_snapshot_xmax(h.t) AND NOT pg_visible_in_snapshot(o.relay_txid, h.f)), false) THEN 'PUBLISHED' ELSE o.publish_state END AS state
              FROM public.outbox o
              LEFT JOIN public.outbox_position p ON p.slot_name = 'outbox_relay';
        GRANT SELECT ON public.outbox_state TO outbox_relay;
        -- A row set to PENDING by hand (to send it again; a row published by
        -- the derived rule is PENDING on disk already) loses its transaction
        -- id: with it, the row would read as published and never be sent.
        -- Without one the poller publishes it (explicit state). Only such
        -- updates fire it (the relay never writes PENDING); inserts cost nothing.
        -- ENABLE ALWAYS: it fires under session_replication_role = replica too
        -- (data fixes run so to skip foreign-key triggers), which an ordinary
        -- trigger does not.
        CREATE OR REPLACE FUNCTION public.outbox_requeue() RETURNS trigger
            LANGUAGE plpgsql AS $requeue$
        BEGIN
            NEW.relay_txid := NULL;
            RETURN NEW;
        END
        $requeue$;
        DROP TRIGGER IF EXISTS outbox_requeue ON public.outbox;
        CREATE TRIGGER outbox_requeue BEFORE UPDATE OF publish_state ON public.outbox
            FOR EACH ROW WHEN (NEW.publish_state = 'PENDING')
            EXECUTE FUNCTION public.outbox_requeue();
        ALTER TABLE public.outbox ENABLE ALWAYS TRIGGER outbox_requeue;
    END IF;
END
$$;
