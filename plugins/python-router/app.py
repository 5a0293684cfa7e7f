"""python-router: an outroute routing plugin written in Python.

Teams that do not write Rust can write routing rules in Python against the
same WIT contract (`wit/router.wit`); componentize-py turns this file into a
WebAssembly component that the relay runs in the same sandbox as any other
plugin. Build: `scripts/build-plugins` (it runs
`componentize-py -d wit -w router componentize app -o python_router.wasm`).

Rule: orders go to `<prefix>.<event_type>`, keyed by aggregate id; an order
whose `total_cents` is at least `priority_cents` gets a `priority: high`
header; events without an `order_id` are rejected as invalid.

Route config: {"sink": "kafka", "prefix": "orders", "priority_cents": 100000}
"""

import json

import wit_world
from componentize_py_types import Err, Ok
from wit_world.imports import host, types

CONFIG = {"sink": "kafka", "prefix": "orders", "priority_cents": 100000}


class WitWorld(wit_world.WitWorld):
    def describe(self) -> types.PluginInfo:
        return types.PluginInfo(name="python-router", version="0.1.0")

    def init(self, config: str) -> None:
        if not config.strip():
            return
        try:
            given = json.loads(config)
        except ValueError as e:
            raise Err(f"python-router: route config is not JSON: {e}")
        unknown = set(given) - set(CONFIG)
        if unknown:
            raise Err(f"python-router: unknown config keys: {sorted(unknown)}")
        CONFIG.update(given)

    def route(self, event: types.Event):
        try:
            order = json.loads(event.payload)
        except ValueError as e:
            return Err(types.Rejection_Invalid(f"payload is not valid JSON: {e}"))
        if not isinstance(order, dict) or "order_id" not in order:
            return Err(types.Rejection_Invalid("payload has no order_id"))
        headers = [("content-type", "application/json")]
        if int(order.get("total_cents", 0)) >= int(CONFIG["priority_cents"]):
            headers.append(("priority", "high"))
            host.log(host.Level.INFO, f"high-priority order {order['order_id']}")
        return Ok(
            [
                types.Message(
                    sink=CONFIG["sink"],
                    topic=f"{CONFIG['prefix']}.{event.event_type}",
                    key=event.aggregate_id.encode(),
                    partition=None,
                    headers=headers,
                    payload=bytes(event.payload),
                )
            ]
        )

    def route_batch(self, events):
        return [self.route(e) for e in events]
