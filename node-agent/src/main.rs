fn main() {
    println!("ramify-node-agent {}", env!("CARGO_PKG_VERSION"));
}
