from loader_server.cli.main import main

main()
