from autoplan.cli import main

main()
