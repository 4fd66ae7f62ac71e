//! `GET /metrics`: the server's counters in Prometheus' text format.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Requests answered, by route and status.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub endpoint: String,
    pub status: u16,
}

/// Every metric the server keeps. Cheap to update from any thread.
pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub prompt_tokens: Counter,
    pub cached_prompt_tokens: Counter,
    pub generated_tokens: Counter,
    pub cancelled: Counter,
    pub queue_depth: Gauge,
    pub in_flight: Gauge,
    pub batch_size: Histogram,
    pub time_to_first_token: Histogram,
    pub time_per_token: Histogram,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("wisp");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register("requests", "HTTP requests answered, by endpoint and status", requests.clone());
        let prompt_tokens = Counter::default();
        registry.register("prompt_tokens", "Prompt tokens fed to the model", prompt_tokens.clone());
        let cached_prompt_tokens = Counter::default();
        registry.register(
            "cached_prompt_tokens",
            "Prompt tokens whose keys and values came from an earlier request's session",
            cached_prompt_tokens.clone(),
        );
        let generated_tokens = Counter::default();
        registry.register("generated_tokens", "Tokens generated", generated_tokens.clone());
        let cancelled = Counter::default();
        registry.register("cancelled", "Generations ended because their client went away", cancelled.clone());
        let queue_depth = Gauge::default();
        registry.register("queue_depth", "Generation requests waiting for a slot", queue_depth.clone());
        let in_flight = Gauge::default();
        registry.register("requests_in_flight", "Generations holding a session", in_flight.clone());
        let batch_size = Histogram::new([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]);
        registry.register("batch_size", "Sessions advanced by one scheduler step", batch_size.clone());
        let latency = || Histogram::new([0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]);
        let time_to_first_token = latency();
        registry.register(
            "time_to_first_token_seconds",
            "From a request's arrival to its first generated token",
            time_to_first_token.clone(),
        );
        let time_per_token = latency();
        registry.register("time_per_output_token_seconds", "Between consecutive tokens of one request", time_per_token.clone());
        Metrics {
            registry,
            requests,
            prompt_tokens,
            cached_prompt_tokens,
            generated_tokens,
            cancelled,
            queue_depth,
            in_flight,
            batch_size,
            time_to_first_token,
            time_per_token,
        }
    }

    /// The text exposition format (`text/plain; version=0.0.4` compatible OpenMetrics).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// Counts one answered request.
    pub fn answered(&self, endpoint: &str, status: u16) {
        self.requests.get_or_create(&RequestLabels { endpoint: endpoint.to_string(), status }).inc();
    }
}
