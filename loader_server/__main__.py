from loader_server.cli import main

main()
