from bench.chaos.main import main

main()
