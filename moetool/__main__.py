from moetool.commands.app import main

main()
