"""Fleet telemetry over MQTT: payload schema, disk spool, client, publisher, commands, fleet view.

    inference threads ──observe()──▶ WindowAccumulator (in memory, bounded, one lock)
                                              │ every interval_s (telemetry thread)
                                              ▼
    Publisher ──append──▶ Spool (SQLite WAL, bounded) ──pump──▶ MqttLink (paho thread) ──▶ broker
                                  ▲                                   │ PUBACK < 0x80
                                  └────────────── delete ◀────────────┘

See docs/telemetry.md for topics, payloads, spool semantics, ``seq`` and the command lifecycle.
Heavy work never runs on paho's network thread: callbacks only enqueue.
"""
