"""The gRPC options every specdec process uses, on its servers and on its channels (the Python client's too: this
module imports nothing)."""

# One speculation round carries at most a few hundred sparse entries; prompts are the largest messages. 16 MiB
# holds a prompt of millions of tokens while keeping one request from exhausting a worker's memory.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# What a server accepts of its clients' keepalive pings on a connection without calls: clients ping every 30 s
# (GRPC_OPTIONS), while gRPC servers by default take one ping per 5 minutes there and answer the third early one
# with GOAWAY too_many_pings, dropping an idle client's connection (seen with the bench's idle clients).
SERVER_OPTIONS = [*GRPC_OPTIONS, ("grpc.http2.min_ping_interval_without_data_ms", 20_000)]
# A restarted worker is found again within a second, not after gRPC's default backoff of up to two minutes.
CHANNEL_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
