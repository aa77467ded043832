-- outbox-relay 010 (`setup --producer-role NAME`): what the application's role
-- may write. relay_txid is the relay's: a row with a forged id could read as
-- published without having been sent. A column privilege cannot take away what
-- a table-level INSERT or UPDATE grants, so the table-level ones are revoked
-- and every column but the relay's is granted instead: the application inserts
-- and updates its own columns (the default fills relay_txid, which needs no
-- privilege), and leaves the relay-managed ones to their defaults. Producers
-- must name their columns in INSERT: an INSERT without a column list targets
-- every column and is refused (docs/producers.md). A column added to the table
-- later needs its own grant: run this again. An owner of the table is bound by
-- no privilege: the application should not own it. Producers insert through
-- the table: on its partitions (an insert straight into one is checked against
-- the partition's privileges alone, and streamed as the table's) the role's
-- INSERT, UPDATE and TRIGGER are revoked, as is TRIGGER on the table (a BEFORE
-- trigger could set relay_txid whatever the column privileges).
DO $$
DECLARE
    outbox  regclass := to_regclass({{'table_regclass'}});
    columns text;
    relays  text;
    part    regclass;
BEGIN
    IF outbox IS NULL THEN
        RETURN;
    END IF;
    SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) INTO columns
      FROM pg_attribute
     WHERE attrelid = outbox AND attnum > 0 AND NOT attisdropped
       AND attname NOT IN ('relay_txid', 'publish_state', 'attempts', 'last_error',
                           'next_attempt_at', 'published_at');
    SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) INTO relays
      FROM pg_attribute
     WHERE attrelid = outbox AND attnum > 0 AND NOT attisdropped
       AND attname IN ('relay_txid', 'publish_state', 'attempts', 'last_error',
                       'next_attempt_at', 'published_at');
    GRANT USAGE ON SCHEMA {{schema}} TO {{producer}};
    REVOKE INSERT, UPDATE ON {{schema}}.{{table}} FROM {{producer}};
    IF relays IS NOT NULL THEN
        EXECUTE format('REVOKE INSERT (%s), UPDATE (%s) ON %s FROM %I', relays, relays, outbox, {{'producer'}});
    END IF;
    REVOKE TRIGGER ON {{schema}}.{{table}} FROM {{producer}};
    FOR part IN SELECT relid FROM pg_partition_tree(outbox) WHERE relid <> outbox LOOP
        EXECUTE format('REVOKE INSERT, UPDATE, TRIGGER ON %s FROM %I', part, {{'producer'}});
        IF relays IS NOT NULL THEN
            EXECUTE format('REVOKE INSERT (%s), UPDATE (%s) ON %s FROM %I', relays, relays, part, {{'producer'}});
        END IF;
    END LOOP;
    GRANT SELECT ON {{schema}}.{{table}} TO {{producer}};
    EXECUTE format('GRANT INSERT (%s), UPDATE (%s) ON %s TO %I', columns, columns, outbox, {{'producer'}});
    IF to_regclass({{'state_view_regclass'}}) IS NOT NULL THEN
        GRANT SELECT ON {{schema}}.{{state_view}} TO {{producer}};
    END IF;
END
$$;
