//! clawrl-actors: the actor system and QUIC cluster runtime.
