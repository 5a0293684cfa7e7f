//! The ordering rules of `pipeline.rs`, against a scripted sink that fails
//! chosen messages at send or at ack time.

//! The ordering table above, case by case, through a scripted sink.
use super::*;
use crate::config::Config;
use crate::event::{Event, Message};
use crate::sink::Sink;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};

/// What the scripted sink does with a message (by payload).
#[derive(Clone)]
enum Script {
    FailSend(PublishError),
    FailAck(PublishError),
    /// The broker never answers.
    NoAck,
}

/// A sink that stores, in send order, what it will acknowledge, and
/// fails the messages it is told to.
#[derive(Default)]
struct ScriptedSink {
    script: Mutex<HashMap<String, Script>>,
    /// Payloads on the "topic", in the order the broker stored them.
    stored: Arc<Mutex<Vec<String>>>,
    sent: Mutex<Vec<String>>,
    session: AtomicU64,
    /// Reconnect (new session) after this many sends.
    reconnect_after: Option<usize>,
    /// Like NATS: messages in flight may be reordered by a reconnect.
    reorders_in_flight: bool,
}

#[async_trait::async_trait]
impl Sink for ScriptedSink {
    fn in_flight(&self) -> Option<&Arc<tokio::sync::Semaphore>> {
        None
    }
    async fn send(
        &self,
        m: Outgoing<'_>,
        _permit: crate::sink::Permit,
    ) -> Result<Ack, PublishError> {
        let payload = String::from_utf8_lossy(m.payload).into_owned();
        let script = self.script.lock().unwrap().get(&payload).cloned();
        if let Some(Script::FailSend(e)) = script {
            return Err(e);
        }
        let n = {
            let mut sent = self.sent.lock().unwrap();
            sent.push(payload.clone());
            sent.len()
        };
        if self.reconnect_after == Some(n) {
            self.session.fetch_add(1, AtomicOrdering::SeqCst);
        }
        // The broker stores in send order and answers on its own, later,
        // whether or not anyone is waiting yet (as brokers and their
        // clients' I/O tasks do).
        let r = match script {
            Some(Script::FailAck(e)) => Err(e),
            Some(Script::NoAck) => return Ok(Ack::new(std::future::pending())),
            _ => {
                self.stored.lock().unwrap().push(payload);
                Ok(())
            }
        };
        let (answer, answered) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            tokio::task::yield_now().await;
            let _ = answer.send(r);
        });
        Ok(Ack::new(async move {
            answered
                .await
                .unwrap_or_else(|_| Err(PublishError::Unavailable("no answer".into())))
        }))
    }
    fn session(&self) -> u64 {
        self.session.load(AtomicOrdering::SeqCst)
    }
    fn keeps_order_in_flight(&self) -> bool {
        !self.reorders_in_flight
    }
    async fn connected(&self) -> bool {
        true
    }
    async fn flush(&self) {}
}

fn pipeline(ordering: Ordering, sink: Arc<ScriptedSink>) -> Pipeline {
    let toml = r#"
        [store]
        url = "postgres://x/y"
        [sinks.k]
        kind = "kafka"
        brokers = "b:9092"
        [sinks.m]
        kind = "kafka"
        brokers = "b:9092"
        [plugins.p]
        path = "p.wasm"
        [[routes]]
        name = "r"
        plugin = "p"
        allow = { k = ["t"], m = ["t"] }
        [[routes]]
        name = "copy"
        plugin = "p"
        allow = { k = ["t"] }
    "#;
    let config: Config = toml::from_str(toml).unwrap();
    let routes = Routes::compile(&config).unwrap();
    let mut sinks: BTreeMap<String, Arc<dyn Sink>> = BTreeMap::new();
    sinks.insert("k".into(), sink);
    Pipeline {
        routes: Arc::new(routes),
        sinks: Arc::new(sinks),
        ordering,
        publish_timeout: Duration::from_secs(5),
        source: "/test".into(),
    }
}

/// Events `X1..Xn` of aggregate `a`, each one message with payload `Xi`.
fn batch(names: &[&str]) -> Vec<(Claim, Plan)> {
    names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let ev = Event {
                id: format!("id-{name}"),
                sequence: i as i64,
                aggregate_type: "order".into(),
                aggregate_id: "a".into(),
                event_type: "e".into(),
                event_version: 1,
                payload: b"{}".to_vec(),
                headers: vec![],
                created_at: chrono::Utc::now(),
                attempts: 0,
            };
            let claim = Claim {
                lane: 0,
                tid: None,
                has_state: false,
                held: Vec::new(),
                done_legs: Vec::new(),
                epoch: None,
                captured: None,
                route: None,
                row: Ok(ev),
            };
            let plan = Plan::Publish {
                route: 0,
                messages: vec![Message {
                    sink: "k".into(),
                    topic: "t".into(),
                    key: None,
                    partition: None,
                    headers: vec![],
                    payload: name.as_bytes().to_vec(),
                }],
            };
            (claim, plan)
        })
        .collect()
}

struct Run {
    fates: Vec<Fate>,
    stored: Vec<String>,
    sent: Vec<String>,
    order_risks: usize,
}

async fn run(ordering: Ordering, fail: (&str, Script), reconnect_after: Option<usize>) -> Run {
    let sink = Arc::new(ScriptedSink {
        reconnect_after,
        ..Default::default()
    });
    sink.script
        .lock()
        .unwrap()
        .insert(fail.0.to_string(), fail.1);
    let p = pipeline(ordering, sink.clone());
    let mut events = batch(&["X1", "X2", "X3"]);
    let d = p.deliver(&mut events, None).await;
    let stored = sink.stored.lock().unwrap().clone();
    let sent = sink.sent.lock().unwrap().clone();
    Run {
        fates: d.fates,
        stored,
        sent,
        order_risks: d.order_risks,
    }
}

/// Routes are subscriptions: the same events on two routes are two
/// orders, and a failure on one never holds the other back.
#[tokio::test]
async fn a_failure_on_one_route_holds_back_only_that_route() {
    for (ordering, script) in [
        (Ordering::Aggregate, Script::FailSend(retry())),
        (Ordering::Aggregate, Script::FailAck(retry())),
        (Ordering::Strict, Script::FailAck(retry())),
    ] {
        let sink = Arc::new(ScriptedSink::default());
        sink.script.lock().unwrap().insert("X1".into(), script);
        let p = pipeline(ordering, sink.clone());
        // Each event on route 0 (payloads X…) and on route 1 (Y…), an
        // event's deliveries side by side as the relay plans them.
        let mut events = Vec::new();
        for ((mut x, mut xp), (mut y, yp)) in batch(&["X1", "X2", "X3"])
            .into_iter()
            .zip(batch(&["Y1", "Y2", "Y3"]))
        {
            x.route = Some(0);
            y.route = Some(1);
            if let Plan::Publish { route, .. } = &mut xp {
                *route = 0;
            }
            let yp = match yp {
                Plan::Publish { messages, .. } => Plan::Publish { route: 1, messages },
                other => other,
            };
            events.push((x, xp));
            events.push((y, yp));
        }
        let d = p.deliver(&mut events, None).await;
        let what = format!("{ordering:?}: {:?}", d.fates);
        assert!(failed(&d.fates[0]), "{what}");
        // Route 0: X2 and X3 wait for X1 (sent or not, never marked).
        assert!(
            matches!(d.fates[2], Fate::Held | Fate::Fail { .. }),
            "{what}"
        );
        assert!(
            matches!(d.fates[4], Fate::Held | Fate::Fail { .. }),
            "{what}"
        );
        // Route 1: every copy delivered, in order.
        assert_eq!(
            [&d.fates[1], &d.fates[3], &d.fates[5]],
            [&Fate::Publish; 3],
            "{what}"
        );
        let stored = sink.stored.lock().unwrap().clone();
        let ys: Vec<&String> = stored.iter().filter(|p| p.starts_with('Y')).collect();
        assert_eq!(ys, ["Y1", "Y2", "Y3"], "{what}");
    }
}

/// A delivery an earlier attempt made is not made again, and is not
/// held back by its route's failures in the batch.
#[tokio::test]
async fn a_route_done_before_sends_nothing() {
    let sink = Arc::new(ScriptedSink::default());
    sink.script
        .lock()
        .unwrap()
        .insert("X1".into(), Script::FailSend(retry()));
    let p = pipeline(Ordering::Aggregate, sink.clone());
    let mut events = batch(&["X1", "X2"]);
    events[1].1 = Plan::Done;
    let d = p.deliver(&mut events, None).await;
    assert!(failed(&d.fates[0]), "{:?}", d.fates);
    assert_eq!(d.fates[1], Fate::Publish);
    assert!(sink.sent.lock().unwrap().is_empty());
}

fn retry() -> PublishError {
    PublishError::Retryable("refused".into())
}

fn failed(f: &Fate) -> bool {
    matches!(f, Fate::Fail { .. })
}

/// An ack that never comes fails its event as "broker unavailable" at
/// the batch's deadline; acks of the other messages count as ever.
#[tokio::test(start_paused = true)]
async fn a_missing_ack_fails_its_event_at_the_deadline() {
    let started = tokio::time::Instant::now();
    let r = run(Ordering::None, ("X2", Script::NoAck), None).await;
    let waited = started.elapsed();
    assert_eq!(r.fates[0], Fate::Publish);
    assert_eq!(r.fates[2], Fate::Publish);
    match &r.fates[1] {
        Fate::Fail {
            rejection,
            broker_retry,
            ..
        } => {
            assert!(broker_retry, "an unanswered publish waits for the broker");
            assert!(
                rejection.reason().contains("publish deadline"),
                "{rejection:?}"
            );
        }
        other => panic!("X2: {other:?}"),
    }
    assert_eq!(r.stored, ["X1", "X3"]);
    // publish_timeout (5 s in `pipeline`) plus the 5 s grace.
    assert!(
        waited >= Duration::from_secs(10) && waited < Duration::from_secs(11),
        "{waited:?}"
    );
}

#[tokio::test]
async fn send_time_failure_of_an_earlier_event() {
    for ordering in [Ordering::Aggregate, Ordering::Strict] {
        let r = run(ordering, ("X1", Script::FailSend(retry())), None).await;
        assert!(failed(&r.fates[0]), "{ordering:?}: {:?}", r.fates);
        assert_eq!(r.fates[1..], [Fate::Held, Fate::Held], "{ordering:?}");
        assert!(
            r.sent.is_empty(),
            "{ordering:?}: later events sent: {:?}",
            r.sent
        );
        assert_eq!(r.order_risks, 0);
    }
    let r = run(Ordering::None, ("X1", Script::FailSend(retry())), None).await;
    assert!(failed(&r.fates[0]));
    assert_eq!(r.fates[1..], [Fate::Publish, Fate::Publish]);
    assert_eq!(r.stored, ["X2", "X3"]);
}

#[tokio::test]
async fn send_time_failure_of_a_later_event() {
    for ordering in [Ordering::Aggregate, Ordering::Strict, Ordering::None] {
        let r = run(ordering, ("X2", Script::FailSend(retry())), None).await;
        assert_eq!(r.fates[0], Fate::Publish, "{ordering:?}");
        assert!(failed(&r.fates[1]), "{ordering:?}");
        let third = if ordering == Ordering::None {
            Fate::Publish
        } else {
            Fate::Held
        };
        assert_eq!(r.fates[2], third, "{ordering:?}");
        assert_eq!(r.stored[0], "X1");
        assert_eq!(r.order_risks, 0);
    }
}

#[tokio::test]
async fn ack_time_failure_of_an_earlier_event() {
    // Aggregate: X2 and X3 were already on their way and are stored
    // before X1 is retried: not marked (re-sent after X1), and counted.
    let r = run(Ordering::Aggregate, ("X1", Script::FailAck(retry())), None).await;
    assert!(failed(&r.fates[0]));
    assert_eq!(r.fates[1..], [Fate::Held, Fate::Held]);
    assert_eq!(r.stored, ["X2", "X3"]);
    assert_eq!(r.order_risks, 2);
    // Strict: X2 waits for X1's ack, so nothing overtakes it.
    let r = run(Ordering::Strict, ("X1", Script::FailAck(retry())), None).await;
    assert!(failed(&r.fates[0]));
    assert_eq!(r.fates[1..], [Fate::Held, Fate::Held]);
    assert_eq!(r.sent, ["X1"]);
    assert!(r.stored.is_empty());
    assert_eq!(r.order_risks, 0);
    // None: independent events.
    let r = run(Ordering::None, ("X1", Script::FailAck(retry())), None).await;
    assert_eq!(r.fates[1..], [Fate::Publish, Fate::Publish]);
    assert_eq!(r.order_risks, 0);
}

#[tokio::test]
async fn ack_time_failure_of_a_later_event() {
    for ordering in [Ordering::Aggregate, Ordering::Strict, Ordering::None] {
        let r = run(ordering, ("X2", Script::FailAck(retry())), None).await;
        assert_eq!(r.fates[0], Fate::Publish, "{ordering:?}");
        assert!(failed(&r.fates[1]), "{ordering:?}");
        match ordering {
            // X3 was sent before X2's ack failed; it is not marked.
            Ordering::Aggregate => {
                assert_eq!(r.fates[2], Fate::Held);
                assert_eq!(r.order_risks, 1);
            }
            Ordering::Strict => {
                assert_eq!(r.fates[2], Fate::Held);
                assert_eq!(r.sent, ["X1", "X2"]);
                assert_eq!(r.order_risks, 0);
            }
            Ordering::None => assert_eq!(r.fates[2], Fate::Publish),
        }
    }
}

#[tokio::test]
async fn a_reconnect_makes_the_aggregate_wait_for_its_earlier_ack() {
    // X1 is lost with the old connection; X2 would go out on the new
    // one. The pipeline awaits X1's ack first and sends nothing more.
    let r = run(
        Ordering::Aggregate,
        ("X1", Script::FailAck(retry())),
        Some(1),
    )
    .await;
    assert!(failed(&r.fates[0]));
    assert_eq!(r.fates[1..], [Fate::Held, Fate::Held]);
    assert_eq!(r.sent, ["X1"]);
    assert_eq!(r.order_risks, 0);
}

#[tokio::test]
async fn on_a_sink_that_may_reorder_in_flight_an_aggregate_has_one_event_in_flight() {
    let sink = Arc::new(ScriptedSink {
        reorders_in_flight: true,
        ..Default::default()
    });
    sink.script
        .lock()
        .unwrap()
        .insert("X1".into(), Script::FailAck(retry()));
    let p = pipeline(Ordering::Aggregate, sink.clone());
    let mut events = batch(&["X1", "X2", "X3"]);
    let d = p.deliver(&mut events, None).await;
    assert!(failed(&d.fates[0]));
    assert_eq!(d.fates[1..], [Fate::Held, Fate::Held]);
    assert_eq!(*sink.sent.lock().unwrap(), ["X1"]);
    assert_eq!(d.order_risks, 0);
}

#[tokio::test]
async fn a_fan_out_leg_acknowledged_once_is_not_sent_again() {
    let k = Arc::new(ScriptedSink::default());
    let m = Arc::new(ScriptedSink::default());
    m.script.lock().unwrap().insert(
        "X1".into(),
        Script::FailAck(PublishError::Unavailable("m is down".into())),
    );
    let mut p = pipeline(Ordering::Aggregate, k.clone());
    let mut sinks: BTreeMap<String, Arc<dyn Sink>> = BTreeMap::new();
    sinks.insert("k".into(), k.clone());
    sinks.insert("m".into(), m.clone());
    p.sinks = Arc::new(sinks);
    let fan_out = |done_legs: Vec<String>| {
        let mut events = batch(&["X1"]);
        events[0].0.done_legs = done_legs;
        if let Plan::Publish { messages, .. } = &mut events[0].1 {
            let mut other = messages[0].clone();
            other.sink = "m".into();
            messages.push(other);
        }
        events
    };
    // First attempt: k acknowledges, m is down.
    let d = p.deliver(&mut fan_out(vec![]), None).await;
    let Fate::Fail {
        done_legs,
        broker_retry: true,
        ..
    } = &d.fates[0]
    else {
        panic!("{:?}", d.fates);
    };
    assert_eq!(done_legs, &["r:k/t#0".to_string()]);
    // The retry sends only m's leg.
    m.script.lock().unwrap().clear();
    let d = p.deliver(&mut fan_out(done_legs.clone()), None).await;
    assert_eq!(d.fates, [Fate::Publish]);
    assert_eq!(*k.sent.lock().unwrap(), ["X1"]);
    assert_eq!(*m.sent.lock().unwrap(), ["X1", "X1"]);
}

#[tokio::test]
async fn unavailable_everywhere_is_an_outage() {
    let sink = Arc::new(ScriptedSink::default());
    for x in ["X1", "X2"] {
        sink.script.lock().unwrap().insert(
            x.into(),
            Script::FailAck(PublishError::Unavailable("down".into())),
        );
    }
    let p = pipeline(Ordering::None, sink);
    let mut events = batch(&["X1", "X2"]);
    let d = p.deliver(&mut events, None).await;
    assert_eq!(d.outage.as_deref(), Some("down"));
}

#[tokio::test]
async fn messages_without_a_key_are_keyed_by_aggregate() {
    #[derive(Default)]
    struct Keys(Mutex<Vec<Option<Vec<u8>>>>);
    #[async_trait::async_trait]
    impl Sink for Keys {
        fn in_flight(&self) -> Option<&Arc<tokio::sync::Semaphore>> {
            None
        }
        async fn send(
            &self,
            m: Outgoing<'_>,
            _p: crate::sink::Permit,
        ) -> Result<Ack, PublishError> {
            self.0.lock().unwrap().push(m.key.map(|k| k.to_vec()));
            Ok(Ack::done())
        }
        async fn connected(&self) -> bool {
            true
        }
        async fn flush(&self) {}
    }
    let keys = Arc::new(Keys::default());
    let mut p = pipeline(Ordering::Aggregate, Arc::new(ScriptedSink::default()));
    let mut sinks: BTreeMap<String, Arc<dyn Sink>> = BTreeMap::new();
    sinks.insert("k".into(), keys.clone());
    p.sinks = Arc::new(sinks);
    let mut events = batch(&["X1", "X2"]);
    if let Plan::Publish { messages, .. } = &mut events[1].1 {
        messages[0].key = Some(b"mine".to_vec());
    }
    p.deliver(&mut events, None).await;
    assert_eq!(
        *keys.0.lock().unwrap(),
        [Some(b"a".to_vec()), Some(b"mine".to_vec())]
    );
}
