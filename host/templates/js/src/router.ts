/**
 * {{name}}: an outroute routing plugin written in TypeScript.
 *
 * Every event goes to one topic built from the event
 * (`<prefix>.<event_type>`), keyed by its aggregate id (one aggregate, one
 * partition: its events stay in order); events whose payload is not a JSON
 * object are refused for good.
 *
 * Route config (the route's `config` key; all optional):
 *   {"sink": "kafka", "prefix": "orders"}
 *
 * Build: ./build.sh  (tsc, then componentize-js against wit/)
 * Test:  ./test.sh   (builds, then runs sample-event.json through the
 *                     relay's own sandbox with `outroute plugin test`)
 */
import { log } from 'outroute:router/host@0.1.1';
import type { Event as RouterEvent, Outcome } from 'outroute:router/types@0.1.1';

const config = { sink: 'kafka', prefix: 'orders' };
const encoder = new TextEncoder();
const decoder = new TextDecoder();

export function describe(): { name: string; version: string } {
  return { name: '{{name}}', version: '0.1.0' };
}

/** The route's config (JSON); throwing refuses the route at start-up. */
export function init(text: string): void {
  if (!text.trim() || text.trim() === 'null') return;
  let given: Record<string, unknown>;
  try {
    given = JSON.parse(text);
  } catch (e) {
    throw `{{name}}: route config is not JSON: ${e}`;
  }
  const unknown = Object.keys(given).filter((k) => !(k in config));
  if (unknown.length > 0) throw `{{name}}: unknown config keys: ${unknown.join(', ')}`;
  Object.assign(config, given);
}

function routeOne(event: RouterEvent): Outcome {
  let payload: unknown;
  try {
    payload = JSON.parse(decoder.decode(event.payload));
  } catch (e) {
    return { tag: 'err', val: { tag: 'invalid', val: `payload is not valid JSON: ${e}` } };
  }
  if (payload === null || typeof payload !== 'object' || Array.isArray(payload)) {
    return { tag: 'err', val: { tag: 'invalid', val: 'the payload is not a JSON object' } };
  }
  log('debug', `routing ${event.eventType} of ${event.aggregateId}`);
  return {
    tag: 'ok',
    val: [
      {
        sink: config.sink,
        topic: `${config.prefix}.${event.eventType}`,
        key: encoder.encode(event.aggregateId),
        partition: undefined,
        headers: [['content-type', 'application/json']],
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
