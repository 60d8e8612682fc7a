//! In-memory fakes of the provider and the transport, for stage-logic tests.
