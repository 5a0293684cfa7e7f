// The `router` world of wit/router.wit as componentize-js presents it to
// JavaScript: records are objects with camelCase fields, list<u8> is a
// Uint8Array, option<T> is T | undefined, a variant is {tag, val}.

declare module 'outroute:router/host@0.1.1' {
  export type Level = 'trace' | 'debug' | 'info' | 'warn' | 'error';
  /** A line in the relay's log, tagged with the plugin and event. */
  export function log(level: Level, message: string): void;
  /**
   * Add `delta` to the plugin's counter `name` (a-z, 0-9, _; at most 32
   * names): `outroute_plugin_count_total{route, plugin, name}`. Since 0.1.1.
   */
  export function count(name: string, delta: bigint): void;
}

// The records of `interface types`, for type annotations only (`import type`
// is erased by tsc: the component imports nothing for them).
declare module 'outroute:router/types@0.1.1' {
  export type Header = [string, string];

  export interface Event {
    id: string;
    sequence: bigint;
    aggregateType: string;
    aggregateId: string;
    eventType: string;
    eventVersion: number;
    payload: Uint8Array;
    headers: Header[];
    createdAtMs: bigint;
    attempt: number;
  }

  export interface Message {
    sink: string;
    topic: string;
    key?: Uint8Array;
    partition?: number;
    headers: Header[];
    payload: Uint8Array;
  }

  export type Rejection = { tag: 'retryable'; val: string } | { tag: 'invalid'; val: string };
  /** A `result<list<message>, rejection>` as componentize-js takes it. */
  export type Outcome = { tag: 'ok'; val: Message[] } | { tag: 'err'; val: Rejection };
}
