/**
 * js-router: an outroute routing plugin written in TypeScript.
 *
 * Teams that write TypeScript can write routing rules against the same WIT
 * contract (`wit/router.wit`); componentize-js turns the compiled module
 * into a WebAssembly component the relay runs in the same sandbox as any
 * other plugin. Build: `npm run build` (scripts/build-plugins runs it).
 *
 * Rule: orders go to `<prefix>.<event_type>`, keyed by aggregate id; an
 * order whose `total_cents` is at least `priority_cents` gets a
 * `priority: high` header; events without an `order_id` are rejected as
 * invalid (for good), a payload that is not JSON too.
 *
 * Route config: {"sink": "kafka", "prefix": "orders", "priority_cents": 100000}
 */
import { log } from 'outroute:router/host@0.1.1';
import type { Event as RouterEvent, Header, Outcome } from 'outroute:router/types@0.1.1';

interface Config {
  sink: string;
  prefix: string;
  priority_cents: number;
}

const config: Config = { sink: 'kafka', prefix: 'orders', priority_cents: 100000 };
const encoder = new TextEncoder();
const decoder = new TextDecoder();

export function describe(): { name: string; version: string } {
  return { name: 'js-router', version: '0.1.0' };
}

/** The route's config (JSON); throwing refuses the route at start-up. */
export function init(text: string): void {
  if (!text.trim() || text.trim() === 'null') return;
  let given: Record<string, unknown>;
  try {
    given = JSON.parse(text);
  } catch (e) {
    throw `js-router: route config is not JSON: ${e}`;
  }
  const unknown = Object.keys(given).filter((k) => !(k in config));
  if (unknown.length > 0) throw `js-router: unknown config keys: ${unknown.join(', ')}`;
  Object.assign(config, given);
}

function invalid(reason: string): Outcome {
  return { tag: 'err', val: { tag: 'invalid', val: reason } };
}

function routeOne(event: RouterEvent): Outcome {
  let order: unknown;
  try {
    order = JSON.parse(decoder.decode(event.payload));
  } catch (e) {
    return invalid(`payload is not valid JSON: ${e}`);
  }
  if (order === null || typeof order !== 'object' || Array.isArray(order) || !('order_id' in order)) {
    return invalid('payload has no order_id');
  }
  const headers: Header[] = [['content-type', 'application/json']];
  const total = Number((order as Record<string, unknown>).total_cents ?? 0);
  if (total >= config.priority_cents) {
    headers.push(['priority', 'high']);
    log('info', `high-priority order ${String((order as Record<string, unknown>).order_id)}`);
  }
  return {
    tag: 'ok',
    val: [
      {
        sink: config.sink,
        topic: `${config.prefix}.${event.eventType}`,
        key: encoder.encode(event.aggregateId),
        partition: undefined,
        headers,
        payload: event.payload,
      },
    ],
  };
}

/** One event: its outcome (componentize-js takes a `result` as {tag, val}). */
export function route(event: RouterEvent): Outcome {
  return routeOne(event);
}

/** Several events in one call: one outcome per event, in order. */
export function routeBatch(events: RouterEvent[]): Outcome[] {
  return events.map(routeOne);
}
