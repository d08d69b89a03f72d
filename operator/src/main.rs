fn main() {
    println!("ramify-operator {}", env!("CARGO_PKG_VERSION"));
}
