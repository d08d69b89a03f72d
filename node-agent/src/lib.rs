//! ramify node agent: the only component that touches runsc.
