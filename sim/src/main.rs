fn main() {
    eprintln!("sim: not built yet (see the sim issue)");
    std::process::exit(2);
}
