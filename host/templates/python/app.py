"""{{name}}: an outroute routing plugin written in Python.

Every event goes to one topic built from the event (`<prefix>.<event_type>`),
keyed by its aggregate id (one aggregate, one partition: its events stay in
order); events whose payload is not a JSON object are refused for good.

Route config (the route's `config` key; all optional):
  {"sink": "kafka", "prefix": "orders"}

Build: ./build.sh   (componentize-py against wit/, the relay's contract)
Test:  ./test.sh    (builds, then runs sample-event.json through the relay's
                     own sandbox with `outroute plugin test`)
"""

import json

import wit_world
from componentize_py_types import Err, Ok
from wit_world.imports import types

CONFIG = {"sink": "kafka", "prefix": "orders"}


class WitWorld(wit_world.WitWorld):
    def describe(self) -> types.PluginInfo:
        return types.PluginInfo(name="{{name}}", version="0.1.0")

    def init(self, config: str) -> None:
        if not config.strip() or config.strip() == "null":
            return
        try:
            given = json.loads(config)
        except ValueError as e:
            raise Err(f"{{name}}: route config is not JSON: {e}")
        unknown = set(given) - set(CONFIG)
        if unknown:
            raise Err(f"{{name}}: unknown config keys: {sorted(unknown)}")
        CONFIG.update(given)

    def route(self, event: types.Event):
        try:
            payload = json.loads(event.payload)
        except ValueError as e:
            return Err(types.Rejection_Invalid(f"payload is not valid JSON: {e}"))
        if not isinstance(payload, dict):
            return Err(types.Rejection_Invalid("the payload is not a JSON object"))
        return Ok(
            [
                types.Message(
                    sink=CONFIG["sink"],
                    topic=f"{CONFIG['prefix']}.{event.event_type}",
                    key=event.aggregate_id.encode(),
                    partition=None,
                    headers=[("content-type", "application/json")],
                    payload=bytes(event.payload),
                )
            ]
        )

    def route_batch(self, events):
        return [self.route(e) for e in events]
