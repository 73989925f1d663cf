from ampaudit.cli import main

main()
