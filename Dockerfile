# syntax=docker/dockerfile:1
# outbox-relay container image.
#
#   docker build -t outbox-relay .
#   docker run --rm -v "$PWD/relay.toml:/etc/outbox-relay/relay.toml:ro" -p 9187:9187 outbox-relay
#
# The configuration is read from /etc/outbox-relay/relay.toml (CMD below);
# every key can also be set with OUTBOX_RELAY__SECTION__KEY. Inside a
# container set `[http] listen = "0.0.0.0:9187"`: the default 127.0.0.1:9187
# cannot be scraped from outside. The HEALTHCHECK asks /healthz on port 9187,
# so keep the listener on that port (an empty `listen` makes it unhealthy).
# Other commands: `docker run … outbox-relay --config /etc/outbox-relay/relay.toml check`.

FROM rust:1-bookworm AS build
WORKDIR /src
# The whole workspace (crates/*, tests, bench): Cargo.lock covers all of its
# members, and the binary compiles in sql/*.sql. .dockerignore drops target/
# and .git/.
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p outbox-relay \
    && install -m 0755 target/release/outbox-relay /usr/local/bin/outbox-relay

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 outbox-relay \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin outbox-relay
COPY --from=build /usr/local/bin/outbox-relay /usr/local/bin/outbox-relay
# The setup SQL, for reading or applying by hand (`outbox-relay setup` prints
# the same files rendered for the configured names).
COPY sql/ /usr/share/outbox-relay/sql/
USER 10001:10001
EXPOSE 9187
# No curl in the image: bash's /dev/tcp speaks the one request.
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9187 && printf 'GET /healthz HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n' >&3 && head -n 1 <&3 | grep -q ' 200 '"]
ENTRYPOINT ["outbox-relay"]
CMD ["--config", "/etc/outbox-relay/relay.toml", "run"]
